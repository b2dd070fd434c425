"""`selfrag batch`: a file of questions answered on Ray Data, with nothing lost (the driver in
`batch_driver`)."""
