"""Deployment: plan, split, sign and push versions; the versions store.

- :mod:`coordinator.deploy.cutting`       plan and cut a model (or read a cut version), run it here
- :mod:`coordinator.deploy.limits`        planned shapes: the ladder tried, the limits enforced
- :mod:`coordinator.deploy.plan`          the devices as the planner sees them; signed deploy bodies
- :mod:`coordinator.deploy.stage_timing`  per-device calibration from the agents' stage times
- :mod:`coordinator.deploy.deployer`      push, health-check, switch, roll back: one at a time
- :mod:`coordinator.deploy.store`         deployments and their versions on disk
"""
