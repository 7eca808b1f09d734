import os
import sys
import tempfile

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# measured costs go to a fresh directory per test session, never to the user's cache
os.environ.setdefault("EAGLE31_CACHE_DIR", tempfile.mkdtemp(prefix="eagle31-test-cache-"))
sys.path.insert(0, os.path.dirname(__file__))


import pytest  # noqa: E402
import torch  # noqa: E402

# An xdist worker gets its share of the cores as torch intra-op threads: two workers of two threads each on two
# cores ran tests/runtime/test_sampling_end_to_end.py + test_batch_invariance.py in 184 s, against 119 s with
# OMP_NUM_THREADS=1 and 133 s with this setting (2026-12-07, one run each). Not through OMP_NUM_THREADS: under it
# a test that then sets 2 threads itself ran 71 s where it takes 47 s.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _WORKERS))


@pytest.fixture(autouse=True)
def _keep_threads():
    """A test (or a module fixture) may set torch's intra-op threads (the real-target tests take 2); the next test
    gets the worker's setting back."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _drop_packed_weights():
    """The batch-invariant linears' packed copies live as long as their weights: dropped after each test, so one
    test's models (a module fixture's may outlive the test) never fill the packing budget of the next."""
    yield
    from eagle_compile.kernels import batch_invariant

    batch_invariant.PACKED.clear()
