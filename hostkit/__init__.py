"""Host chores shared by the agent and the coordinator (a leaf: it imports nothing of ours).

- :mod:`hostkit.files`      atomic file writes (a crash never leaves a torn file), temp sweeps
- :mod:`hostkit.processes`  stopping a child process and everything it started
"""
