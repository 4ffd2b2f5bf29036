"""The built-in recipes: each file is a script that `freetx run` launches; this package only lets the wheel carry them."""
