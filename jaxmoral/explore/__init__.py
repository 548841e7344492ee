"""`jaxmoral explore DIR [DIR ...]`: a local, read-only web view of jaxmoral's outputs.

The explorer serves, on 127.0.0.1, pages for whatever the folders hold (NPOV detections and
ROC curves, ClarifyDelphi evaluations and chats, Diamante rankings and self-chats, training
runs, experiment results) and, where a model folder is among them, boxes that call the
library on a typed input. It never writes into the folders it shows; every path the browser
names is confined to them (`folders.Roots`).
"""
