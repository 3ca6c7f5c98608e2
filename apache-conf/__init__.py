"""Apache httpd and tc templates, installed as ``overtake.apache_conf`` package data.

Nothing to import: :mod:`overtake.controller.harness.apache` reads these files with
:mod:`importlib.resources`, so an installed wheel finds them outside the checkout.
"""
