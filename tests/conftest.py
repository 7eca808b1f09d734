import os
import sys
import tempfile

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# measured costs go to a fresh directory per test session, never to the user's cache
os.environ.setdefault("EAGLE31_CACHE_DIR", tempfile.mkdtemp(prefix="eagle31-test-cache-"))
sys.path.insert(0, os.path.dirname(__file__))


import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _keep_threads():
    """A test (or a module fixture) may set torch's intra-op threads (the real-target tests take 2); the next test
    gets the session's setting back (scripts/test.sh gives each worker its share of the cores)."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _drop_packed_weights():
    """The batch-invariant linears' packed copies live as long as their weights, and a test session keeps many
    models alive (dynamo's caches): dropped after each test, so the suite's memory stays what it was without."""
    yield
    from eagle_compile.kernels import batch_invariant

    batch_invariant.PACKED.clear()
