"""The smoke check of `nightwatch validate --smoke`: the spec's features trained at a tiny size
on this host (`plan`: what to run, pure; `run`: running it)."""
