"""Launching on clusters: SLURM batch scripts and per-node torchrun commands. freetx
writes and drives torchrun (c10d rendezvous); it does not replace it."""

from freetx.launch.scripts import LaunchSpec, slurm_script, torchrun_commands, torchrun_script

__all__ = ["LaunchSpec", "slurm_script", "torchrun_commands", "torchrun_script"]
