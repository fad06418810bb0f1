from reshard.cli import run

run()
