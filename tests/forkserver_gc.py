"""What the test session's forkserver imports first (conftest.py puts it in every preload list): the cyclic
collector's threshold of the test processes (conftest.py's ``pytest_configure``), so that the gloo ranks forked from
the server (``measure_jobs(..., start_method="forkserver")`` and the pipeline mesh runs) inherit it, as the ranks
forked from a test process (``forked_ranks``) do.  Under the default threshold the ranks spent ~18% more CPU (the
ZeRO-1 spawn: 9.2 s against 7.5 s, tree CPU) walking the recorder's and the engines' objects, almost none in cycles;
the recorder collects where it needs to, so every measured byte is the same."""

import gc

gc.set_threshold(200_000, 30, 30)
