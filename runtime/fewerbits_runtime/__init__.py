"""fewerbits_runtime: what runs in the serving pod.

* ``python -m fewerbits_runtime fetch``: the init container; downloads and verifies one artifact
  (``fewerbits_runtime.fetch``).
* ``python -m fewerbits_runtime launch -- vllm serve ...``: the serving container's entrypoint;
  checks the GPU's compute capability against the artifact's format, then runs vLLM as its child
  (``fewerbits_runtime.launch``; vLLM's root cause becomes the termination message).

Depends only on the base dependencies of the distribution (boto3, pydantic): no torch.
"""
