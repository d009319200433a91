"""The resolver (DESIGN §1 stage 2): class -> depth profile -> the parameters it reaches -> noise schedule."""
