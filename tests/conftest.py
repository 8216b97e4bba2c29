import os

# Tests run on 2 CPU cores in CI; keep each process from oversubscribing them.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
if not torch.cuda.is_available():
    # Triton kernels (sparsp.cdf_select) run in Triton's interpreter on CPU tensors; the switch
    # must be on before Triton is first imported. On a GPU machine they compile as in use.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption("--soak-calls", type=int, default=None, metavar="N",
                     help="run test_soak.py's long soak with N calls (`make soak`: 5000); "
                          "without it that test is skipped")
    parser.addoption("--doc-outputs", action="store_true",
                     help="also remake docs/analysis.md's tables from their eight `sparsp analyze` runs "
                          "(`make doc-outputs`, minutes); without it those tests are skipped")
