"""What reaches the disk, for the library and the harness alike: writes a reader sees whole or
not at all (`atomic`), the buffer recordings gates run on (`buffers`), and bounded reads of the
suite's JSON files (`jsonfile`). Nothing here knows of gates, reports or the CLI."""
