"""Built-in passes: importing this package registers each of them (one pass per file)."""
from fxdream.passes import (
    aux_stream_backward,  # noqa: F401
    bf16_inference,  # noqa: F401
    cuda_graphs,  # noqa: F401
    fuse_attention,  # noqa: F401
    fuse_conv_bias_act,  # noqa: F401
    fuse_gelu,  # noqa: F401
    mark_incompatible,  # noqa: F401
    onednn_graph,  # noqa: F401
    prepack_linear,  # noqa: F401
    reinplace,  # noqa: F401
)
