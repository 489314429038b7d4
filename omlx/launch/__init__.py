"""`omlx launch claude|codex|opencode`: point a coding agent at an oMLX server (started if none
answers) through its own environment, flags or a config file of ours, never the user's files."""
