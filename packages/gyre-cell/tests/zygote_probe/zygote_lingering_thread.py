"""A preload that leaves a non-daemon thread running forever, as a library's worker pool may: an interpreter that
shuts down normally waits for it."""

import threading

threading.Thread(target=threading.Event().wait, name="never-ends").start()
