"""Pipeline logic, plain Python with no Triton import: text, vision, speech, scoring, the ONNX
runner of the embedded target, and the router. The ``model.py`` adapters (through ``stub``) call it."""
