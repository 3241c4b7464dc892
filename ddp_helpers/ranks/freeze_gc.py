"""Imported last by the forkserver (startmethod.FORKSERVER_PRELOAD): stop the launcher watch, freeze the heap.

A forked rank's first garbage collection would otherwise walk the millions of objects torch and torch._dynamo
created in the server (~0.18 s of every start-up measured here); frozen, they are skipped. This module's only
job is that side effect, and nothing but the forkserver imports it.
"""
import gc

from ddp_helpers.ranks.server_watch import stop

stop()  # the preloads are done: fork the ranks from one thread
gc.collect()
gc.freeze()
