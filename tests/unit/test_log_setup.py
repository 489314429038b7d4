"""Log files: rolled over by day, the newest `--log-retention-days` kept, request id and model
on each line."""

from __future__ import annotations

import logging
import os
import threading
import time

from omlx.server.log_setup import LOG_FILE, RequestContext, bind, file_handler


def test_a_later_day_rolls_the_file_over_and_keeps_the_newest_days(tmp_path):
    current = tmp_path / LOG_FILE
    current.write_text("from three days ago\n")
    three_days_ago = time.time() - 3 * 86400
    os.utime(current, (three_days_ago, three_days_ago))
    for day in range(1, 6):  # five older rolled-over files
        (tmp_path / f"{LOG_FILE}.2020-01-0{day}").write_text("old\n")
    handler = file_handler(tmp_path, retention_days=2)
    handler.setFormatter(logging.Formatter("%(request_id)s %(model)s %(message)s"))
    handler.addFilter(RequestContext())
    log = logging.getLogger("omlx.test-rotation")
    log.propagate = False
    log.addHandler(handler)
    try:
        bind(request_id="chatcmpl-1", model="m")
        log.warning("served")

        def on_engine_thread() -> None:  # a new thread starts with no request bound
            log.warning("request=%s model=%s finished", "msg-2", "tiny")

        worker = threading.Thread(target=on_engine_thread, name="engine:tiny")
        worker.start()
        worker.join()
    finally:
        log.removeHandler(handler)
        handler.close()
    rolled = sorted(p.name for p in tmp_path.iterdir() if p.name != LOG_FILE)
    assert len(rolled) == 2 and rolled[-1] != f"{LOG_FILE}.2020-01-05"  # the one just rolled is kept
    assert current.read_text().splitlines() == ["chatcmpl-1 m served", "msg-2 tiny request=msg-2 model=tiny finished"]
