from opsd_rollout.cli import run

run()
