"""Work in flight: handing it out (batches reserved in the data ledger, parameters or their changes published and delivered), taking it back and giving it up."""
