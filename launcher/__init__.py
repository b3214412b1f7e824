"""``dtlaunch`` and ``spawn``: start N MPI ranks of a script or a function."""
