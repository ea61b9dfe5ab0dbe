from cpchat.cli import entry

entry()
