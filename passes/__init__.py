"""Built-in passes: importing this package registers each of them (one pass per file)."""
from fxdream.passes import fuse_conv_bias_act  # noqa: F401
from fxdream.passes import fuse_attention  # noqa: F401
from fxdream.passes import prepack_linear  # noqa: F401
from fxdream.passes import mark_incompatible  # noqa: F401
from fxdream.passes import cuda_graphs  # noqa: F401
from fxdream.passes import aux_stream_backward  # noqa: F401
from fxdream.passes import reinplace  # noqa: F401
