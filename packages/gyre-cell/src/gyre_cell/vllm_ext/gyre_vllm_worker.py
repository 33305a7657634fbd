"""A vLLM worker extension (`--worker-extension-cls gyre_vllm_worker.GyreWorkerExtension`): vLLM mixes this class
into its worker, and `POST /collective_rpc {"method": "gyre_load_safetensors", "kwargs": {"path": ...}}` calls it
on every worker. This file runs inside vLLM's interpreter: it imports vLLM's own dependencies, nothing of Gyre.

Why not vLLM's `reload_weights` by path alone: on CPU every linear layer is prepacked (oneDNN) and a tied LM head
gets no tensor of its own from the checkpoint, so after an in-place reload the server ran the new body with the old
head. Re-running the head's post-load step after the reload packs the new (tied) embedding into it.
"""

from __future__ import annotations


class GyreWorkerExtension:
    def gyre_load_safetensors(self, path: str) -> int:
        """Load every tensor of the safetensors file `path`, or of every `*.safetensors` file in the checkpoint
        directory `path`, in place (a full set of weights); returns how many."""
        import os

        from safetensors.torch import load_file

        files = (
            sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
            if (os.path.isdir(path))
            else [path]
        )
        tensors = {}
        for file in files:
            tensors.update(load_file(file))
        if not tensors:
            raise ValueError(f"no tensors in {path}")
        self.reload_weights(weights_iterator=iter(tensors.items()))
        self._gyre_relink_lm_head()
        return len(tensors)

    def _gyre_relink_lm_head(self) -> None:
        model = self.model_runner.get_model()
        config = getattr(model, "config", None)
        if not getattr(config, "tie_word_embeddings", False):
            return
        head = getattr(model, "lm_head", None)
        method = getattr(head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(head)
