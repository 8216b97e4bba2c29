import os

# Tests run on 2 CPU cores in CI; keep each process from oversubscribing them.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
