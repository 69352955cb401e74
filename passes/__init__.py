"""Built-in passes: importing this package registers each of them (one pass per file)."""
from . import fuse_conv_bias_act  # noqa: F401
from . import fuse_attention  # noqa: F401
from . import prepack_linear  # noqa: F401
from . import mark_incompatible  # noqa: F401
from . import cuda_graphs  # noqa: F401
from . import aux_stream_backward  # noqa: F401
from . import reinplace  # noqa: F401
