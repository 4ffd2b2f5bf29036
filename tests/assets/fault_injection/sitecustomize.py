"""Fault injection for checkpoint tests, loaded only when a test puts this folder
on PYTHONPATH. With FREETX_TEST_KILL_SAVE=<step name> (e.g. step_000006), rank 1
writes a partial data file into that save's folder and dies on the spot, the
way a node crash would leave a save half done."""

import os

_target = os.environ.get("FREETX_TEST_KILL_SAVE")
if _target:
    from torch.distributed.checkpoint import filesystem

    _write_data = filesystem._FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if os.environ.get("RANK") == "1" and str(self.path).endswith(_target):
            with open(os.path.join(str(self.path), "__1_0.distcp"), "wb") as f:
                f.write(b"\0" * 1000)
            os._exit(1)
        return _write_data(self, plan, planner)

    filesystem._FileSystemWriter.write_data = write_data
