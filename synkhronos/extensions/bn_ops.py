"""The batch-norm Ops' import path before they moved into ``ops/``: ``ops.batch_norm`` itself."""

import sys

from .ops import batch_norm

sys.modules[__name__] = batch_norm
