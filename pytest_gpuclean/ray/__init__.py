"""The Ray extension: a cluster's nodes read and reaped through an agent (a Ray driver of its own) and a task
pinned to each node, the cluster's part of the outputs, and ``gpuclean status/check/reap --ray``. (Empty:
importing a layer loads none of its modules.)"""

