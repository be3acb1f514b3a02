"""Speech pipeline logic: audio bytes → 16 kHz mono → Whisper log-mel windows, the Whisper
tokenizer (tiktoken, offline), and greedy decoding of the ``whisper_encoder``/``whisper_decoder``
ONNX pair.

Everything here is plain numpy (plus soundfile, soxr, tiktoken, onnxruntime for the in-process
reference); the Triton models ``audio_features`` and ``whisper_decode`` are thin adapters over it.

One module per job: config (constants), audio, windows, features, tokenizer, decoding (the greedy
loop), jobs (requests), streaming, reference (ONNX Runtime in process)."""
