"""The worker extension the vLLM tests' shared ``LLM`` runs: paramstore's, and a way to corrupt the
engine's weights (issue 28: an update must make corrupted weights the version again).

It is imported by the worker process (``worker_extension_cls="vllm_worker.CorruptingWorkerExtension"``,
this directory on ``PYTHONPATH``): vLLM sends RPCs by method name, not functions.
"""

from __future__ import annotations

from paramstore.integrations.vllm import ParamStoreWorkerExtension


class CorruptingWorkerExtension(ParamStoreWorkerExtension):
    def corrupt_weights(self) -> int:
        """Change every weight the engine computes with: each floating-point parameter, and each
        prepacked CPU kernel (whose module keeps an empty ``weight``); return how many."""
        changed = 0
        for module in self.get_model().modules():
            for p in module.parameters(recurse=False):
                if p.numel() and p.is_floating_point():
                    p.data.add_(0.5)
                    changed += 1
            kernel = getattr(module, "cpu_linear", None)
            if callable(kernel):
                module.cpu_linear = lambda x, w, b, kernel=kernel: kernel(x, w, b) + 0.5
                changed += 1
        return changed
