"""A worker thread that can be walked away from.

Publications run one at a time off the loop thread. A call stuck inside the Kafka client
(librdkafka #5511) cannot be cancelled; ``abandon()`` leaves it on its thread and starts a new
thread for the next call. The threads are daemons, so a call that never returns does not hold
up the process's exit (a ThreadPoolExecutor's threads are joined at exit).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

_STOP = object()


class DetachedWorker:
    def __init__(self, name: str) -> None:
        self.name = name
        self.abandoned = 0
        self._start()

    def _start(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(self._queue,), name=self.name, daemon=True)
        self._thread.start()

    @staticmethod
    def _run(tasks: queue.SimpleQueue) -> None:
        while True:
            task = tasks.get()
            if task is _STOP:
                return
            future, fn, args = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as error:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(error)

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def abandon(self) -> None:
        """Leave the thread to its current call; later calls run on a new thread."""
        self._queue.put(_STOP)       # it stops if its call ever returns
        self.abandoned += 1
        self._start()

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        self._queue.put(_STOP)
        if wait:
            self._thread.join()
