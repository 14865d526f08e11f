"""Deployment: plan, split, sign and push versions; the versions store.

- :mod:`coordinator.deploy.cutting`       plan and cut a model (or read a cut version), run it here
- :mod:`coordinator.deploy.limits`        planned shapes: the ladder tried, the limits enforced
- :mod:`coordinator.deploy.plan`          the devices as the planner sees them; signed deploy bodies
- :mod:`coordinator.deploy.stage_timing`  per-device calibration from the agents' stage times
- :mod:`coordinator.deploy.deployer`      push, health-check, switch, roll back: one at a time
- :mod:`coordinator.deploy.store`         deployments and their versions on disk
- :mod:`coordinator.deploy.pushing`       a version's segments to its agents: hosts in parallel
- :mod:`coordinator.deploy.model_files`   what kind of model file a deploy was given (ONNX, GGUF)
- :mod:`coordinator.deploy.onnx_inline`   one self-contained ONNX file from external-data weights
- :mod:`coordinator.deploy.term_fit`      per-term roofline corrections fitted on measured stages
- :mod:`coordinator.deploy.unit_residuals`  what the per-term fit leaves, per planning unit
- :mod:`coordinator.deploy.peak_memory`   this process's peak resident memory over some work
- :mod:`coordinator.deploy.gguf_cut`      a deploy from a GGUF file: planned from its header,
  each stage's segment built from the file
- :mod:`coordinator.deploy.gguf_stages`   its stages built, run and probed one segment at a time
- :mod:`coordinator.deploy.gguf_manifest` its manifest from the plan, unit table and stages
- :mod:`coordinator.deploy.gguf_plan`     a GGUF decoder's planning problem from its header alone
- :mod:`coordinator.deploy.gguf_what_if`  the console's what-if for a GGUF version, from its header
- :mod:`coordinator.deploy.gguf_tokenizer`  a GGUF file's tokenizer as a ``tokenizer.json``
"""
