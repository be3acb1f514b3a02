"""The one reader of Prometheus text (triton_pipelines/prometheus_text.py) that the rollout, the
tests and the benchmarks share; no server."""

from __future__ import annotations

import math

from triton_pipelines.prometheus_text import Sample, parse_samples, total

from tests.support.router_helpers import metric

TEXT = ('# HELP nv_inference_request_failure Number of failed inference requests\n'
        '# TYPE nv_inference_request_failure counter\n'
        'nv_inference_request_failure{model="a",version="1"} 2\n'
        'nv_inference_request_failure{model="b",version="1"} 3\n'
        'nv_inference_request_summary_us{model="a",version="2",quantile="0.99"} NaN\n'
        'launcher_tritonserver_restarts_total 1\n'
        'escaped{path="a\\"b"} 7\n'
        'not_a_number{model="a"} abc\n')


def test_samples_are_names_labels_and_numbers():
    samples = parse_samples(TEXT)
    assert samples[0] == Sample("nv_inference_request_failure", {"model": "a", "version": "1"}, 2.0)
    assert samples[3] == Sample("launcher_tritonserver_restarts_total", {}, 1.0)
    assert samples[4].labels == {"path": 'a\\"b'}  # escapes kept
    assert math.isnan(samples[2].value)
    assert [s.name for s in samples].count("not_a_number") == 0 and len(samples) == 5


def test_totals_match_labels_or_any_of_several():
    samples = parse_samples(TEXT)
    assert total(samples, "nv_inference_request_failure", version="1") == 5
    assert total(samples, "nv_inference_request_failure", model=["a", "c"]) == 2
    assert total(samples, "nv_inference_request_failure", model=()) == 0
    assert total(samples, "missing") == 0


def test_the_tests_helper_reads_the_same_numbers():
    assert metric(TEXT, "nv_inference_request_failure", model="b") == 3
    assert metric(TEXT, "launcher_tritonserver_restarts_total") == 1


def test_a_written_family_reads_back_with_its_labels_escaped():
    from triton_pipelines.prometheus_text import family, parse_samples

    text = "\n".join(family("x_total", "counter", "help", ("key_name", "model"),
                            {("team-a", 'say "hi"'): 2, ("team-b", "m"): 1.5}, "{:.3f}")) + "\n"
    assert text.startswith("# HELP x_total help\n# TYPE x_total counter\n")
    assert 'x_total{key_name="team-a",model="say \\"hi\\""} 2.000' in text
    samples = parse_samples(text)
    assert total(samples, "x_total") == 3.5 and total(samples, "x_total", key_name="team-b") == 1.5
