"""How each compute model's ONNX file is made from its weights (PyTorch export, ONNX graph
surgery), one module per model family. The model descriptions (``*_pipeline.py``) name these
functions; the builder hashes the module of the function it calls, so a change to export code
re-exports the models it makes."""
