"""The Ray extension: a cluster's nodes read and reaped through an agent on each node, and ``gpuclean
check/reap --ray``. (Empty: importing a layer loads none of its modules.)"""
