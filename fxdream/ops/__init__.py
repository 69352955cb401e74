"""torch.library custom ops fxdream puts in graphs, one per file, and the mode that keeps
composite calls whole while a graph is traced (``keep_whole``).

Importing this package registers every op, so a graph holding one can run in any process
that imported fxdream."""
from fxdream.ops import fused_conv, keep_whole, max_pool1d, pad, rnn, rnn_cell, sdpa, upsample  # noqa: F401
