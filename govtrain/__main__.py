"""`python -m govtrain ...`: the `govtrain` command, as `torchrun ... -m govtrain train ...` starts each rank."""

from govtrain.cli.main import main

if __name__ == "__main__":
    main()
