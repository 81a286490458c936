from lit_parl.cli import main

main()
