"""`jaxmoral explore DIR [DIR ...]`: a local, read-only web view of jaxmoral's outputs.

Pages for whatever the folders hold (NPOV, ClarifyDelphi and Diamante outputs, runs,
experiment results) and, with a model folder among them, boxes that call the library on a
typed input. Nothing is written into the folders; every browser path is confined to them.
"""
