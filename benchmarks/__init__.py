"""`make bench`: perf_analyzer against the embedded server next to in-process baselines.
Each pipeline's benchmark is a module here listed in ``benchmarks.__main__.BENCHMARKS``; its
``run(server)`` returns a Markdown section that lands in docs/benchmarks.md."""
