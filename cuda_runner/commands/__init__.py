"""The commands as library calls: a typed request in, a typed result out.

`running` (run), `bench`, `batch` (run --batch, with `stacking`) and
`inspection` (inspect) do the work of the CLI's commands; the CLI parses
options into their requests and renders their results, and nothing here
knows about it.
"""
