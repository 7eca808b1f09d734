import os
import sys
import tempfile

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# measured costs go to a fresh directory per test session, never to the user's cache
os.environ.setdefault("EAGLE31_CACHE_DIR", tempfile.mkdtemp(prefix="eagle31-test-cache-"))
sys.path.insert(0, os.path.dirname(__file__))
