"""The resolver (docs/design.md §1 stage 2): class -> depth profile -> the parameters it reaches -> noise schedule."""
