"""CTR models on gathered embedding rows: DeepFM, Wide&Deep, DCN, DCNv2.

    layers     the building blocks (MLP, linear logit, FM term, cross networks)
    networks   the four models and `build_model`

May import config only (and torch).
"""
from stream_ctr.models.networks import CTRModel, build_model

__all__ = ["CTRModel", "build_model"]
