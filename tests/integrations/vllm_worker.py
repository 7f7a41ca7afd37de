"""The worker extension the vLLM tests' shared ``LLM`` runs: paramstore's, and a way to corrupt the
engine's weights (issue 28: an update must make corrupted weights the version again), and a recipe
the CPU engine can load (issue 29: an update in a recipe's form).

It is imported by the worker process (``worker_extension_cls="vllm_worker.CorruptingWorkerExtension"``,
this directory on ``PYTHONPATH``): vLLM sends RPCs by method name, not functions.
"""

from __future__ import annotations

import torch

from paramstore import recipes
from paramstore.integrations.vllm import ParamStoreWorkerExtension

#: A recipe the CPU engine can load (its FP8 ones need kernels this CPU build lacks): every 2-D
#: float32 weight rounded to bfloat16; the fp32 engine's loader widens it back on load.
ROUNDED = recipes.register(recipes.Recipe(
    "bf16-rounded", 1, lambda name, t: t.dim() == 2 and t.dtype == torch.float32,
    lambda name, t: {name: t.to(torch.bfloat16)}, description="tests: 2-D float32 weights in bfloat16"), replace=True)


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
