"""The kernel's uprobe_events probe syntax: the parser, its error table, and fetch-argument evaluation."""
