"""Reading and (later) writing checkpoints: the reader layer every command stands on."""
