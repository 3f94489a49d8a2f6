"""CTR models on gathered embedding rows: DeepFM, Wide&Deep, DCN, DCNv2.

    layers     the building blocks (MLP, linear logit, FM term, cross networks)
    networks   the four models and `build_model`
    field_inputs  a batch's keys (fixed and multi-hot) -> the models' [B, F + M] inputs
    scoring    precision, the forward on decoded rows, a file's scores: what training's
               held-out scoring, eval, predict and serve share

May import config, connectors (the Batch) and ops (and torch).
"""
from stream_ctr.models.networks import CTRModel, build_model

__all__ = ["CTRModel", "build_model"]
