import os

import torch

# Without a GPU, Triton kernels run under its interpreter; it must be on before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest's own fixture for running pytest in a directory of its own (the --suite plugin's tests)
pytest_plugins = ["pytester"]
