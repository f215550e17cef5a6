"""The drift runner (drift/runner.py): recover.yml in check mode on a schedule, through ansible-runner."""
