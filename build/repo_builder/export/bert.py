"""BERT encoders (``text_encoder``, ``bert_base_encoder``) to ONNX. This module is hashed into the
exported models' content key: a change here re-exports them."""

from __future__ import annotations

from pathlib import Path


POOLINGS = ("mean", "cls")


def export_bert(checkpoint: Path | None, onnx_path: Path, random_seed: int = 0, pooling: str = "mean",
                normalize: bool = True) -> None:
    """A BERT-family encoder (``AutoModel``) → ONNX (legacy exporter, opset 17) with dynamic batch
    and sequence axes. Outputs: ``last_hidden_state`` and ``embedding``, the model's
    sentence-transformers pooling as graph ops (``pooling``: "mean" of the token states under the
    mask, or the "cls" token's state; then the unit L2 norm if ``normalize``:
    ``text.mean_pool_normalize`` is the reference of the default), so the served pipeline has no
    Python hop after the encoder and ONNX Runtime computes only what a caller asks for.

    ``checkpoint=None`` builds bert-base-uncased's architecture with deterministic random weights.
    """
    import torch
    from transformers import AutoModel, BertConfig, BertModel

    if pooling not in POOLINGS:
        raise ValueError(f"unknown pooling {pooling!r}; one of {POOLINGS}")
    if checkpoint is None:
        torch.manual_seed(random_seed)
        model = BertModel(BertConfig(), add_pooling_layer=False)
    else:
        try:  # BERT, RoBERTa, MPNet ...: their pooler (the classification head's) is not the sentence pooling
            model = AutoModel.from_pretrained(str(checkpoint), add_pooling_layer=False)
        except TypeError:
            model = AutoModel.from_pretrained(str(checkpoint))
    model.eval()

    class EncoderWithPooling(torch.nn.Module):
        def __init__(self, bert):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            if pooling == "cls":
                pooled = hidden[:, 0]
            else:
                mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            if not normalize:
                return hidden, pooled
            return hidden, pooled / torch.linalg.vector_norm(pooled, dim=1, keepdim=True).clamp(min=1e-12)

    ids = torch.ones((2, 16), dtype=torch.int64)
    with torch.no_grad():
        torch.onnx.export(
            EncoderWithPooling(model), (ids, torch.ones_like(ids)), str(onnx_path),
            input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state", "embedding"],
            dynamic_axes={"input_ids": {0: "batch", 1: "sequence"},
                          "attention_mask": {0: "batch", 1: "sequence"},
                          "last_hidden_state": {0: "batch", 1: "sequence"}, "embedding": {0: "batch"}},
            opset_version=17, dynamo=False,
        )
